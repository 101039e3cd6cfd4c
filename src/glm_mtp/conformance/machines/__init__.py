"""The conformance suite's hypothesis state machines (they need hypothesis; the rest of the suite
does not): ``machine`` (``lockstep_machine``: the adversarial generator's rules as a
``RuleBasedStateMachine``, well-formed ops as data on two backends in lockstep), ``arguments``
(``argument_machine``: hostile raw arguments to every public call of the drafter contract, on two
backends at once) and ``hostile_values`` (the argument values that machine draws).

    from glm_mtp.conformance.machines.machine import lockstep_machine
    from glm_mtp.conformance.machines.arguments import argument_machine
"""
