"""What the speculative loop verifies against: ``target`` (a small target of the drafter's family,
GLM-5 or glm5_next, built from the drafter's own layer code), ``hf_target`` (a released
checkpoint's own target, run by transformers), ``replay`` (a trace replayed as the target, no
target weight loaded: DESIGN.md §11), ``checkpoint`` (finding and loading the shipped checkpoints
or any the training wrote), ``provenance`` (the code's commit and the hashes of the files a result
read).

May import ``glm_mtp.reference``, ``glm_mtp.registry`` and ``experiments.training``'s tokenizer;
transformers only inside ``hf_target``'s functions.
"""
