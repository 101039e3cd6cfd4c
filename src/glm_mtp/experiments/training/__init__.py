"""Training's pieces: ``train_run`` (the toy target and its MTP head trained jointly: the job of
``experiments/train.py``), ``corpus`` (the Python standard library's sources, split by item),
``bpe`` (its byte-level BPE tokenizer), ``model_card`` (the trained checkpoint's README),
``indexer_loss`` (the glm5_next KPool indexer trained by DSA's KL).

May import ``glm_mtp.reference``, ``glm_mtp.tools``, ``experiments.targets`` and
``experiments.reporting`` (``train_run``'s logger).
"""
