"""The operations behind :class:`durably.WorkflowContext`, one module per family.

``WorkflowContext`` only checks arguments and takes each call's position; the
work happens here, against an explicit :class:`~durably._ops.env.TurnEnv`
instead of the context's private members, so no operation imports the
context and each family can be read (and changed) alone:

- :mod:`.env`: what every operation shares (the turn, the engine's services,
  checkpoint writes, the lease-fence exit);
- :mod:`.local_step`: in-process steps and recorded values;
- :mod:`.step`: dispatched steps;
- :mod:`.waits`: timers, signal and event waits;
- :mod:`.fan`: child runs and ``ctx.all``;
- :mod:`.saga`: compensations.
"""
