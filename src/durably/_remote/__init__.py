"""Remote workflow turns: workflows whose body runs in a worker elsewhere
(``durable-worker``, the upstream TypeScript runtimes), advanced one turn at a
time over the upstream's WorkflowTask / WorkflowDecision wire (:mod:`.wire`),
by :class:`.turns.RemoteTurns`."""
