"""Training's pieces (the loop itself is ``experiments/train.py``): ``corpus`` (the Python
standard library's sources, split by item), ``bpe`` (its byte-level BPE tokenizer),
``model_card`` (the trained checkpoint's README), ``indexer_loss`` (the glm5_next KPool indexer
trained by DSA's KL).

May import ``glm_mtp.reference``, ``glm_mtp.tools`` and ``experiments.targets``.
"""
