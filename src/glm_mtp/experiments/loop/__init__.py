"""The speculative loop and what it measures: ``speculative`` (the loop of DESIGN.md §4 and its
acceptance metrics, over any ``DraftProposer``), ``round`` (one round of it, written once: draft,
width, verify, the rollback policies, timing), ``verify`` (the verification rules by name: greedy,
rejection sampling), ``grammar_verify`` (the verification masked by a grammar's matcher, DESIGN.md
§10), ``stats`` (bootstrap intervals over prompts), ``speedup`` (the speedup model
S(k) = tau(k) / (1 + k c + v(k)) and its costs, measured or from the bytes each step reads),
``recall`` (the drafter's sparse selection and the indexer's recall), ``stop_rules`` (how many
of a round's drafts to verify, from their confidences), ``oracle`` (the hindsight-best width),
``calibration`` (acceptance against the confidences) and ``feed_agreement`` (whether two feeds'
drafts differ: the training grid's feed ablation).

May import ``glm_mtp.reference``, ``glm_mtp.registry`` and ``glm_mtp.tools``; the target is
reached through the ``TargetModel`` interface, never imported.
"""
