"""The data of a step, framework-free: rollouts and their validation (``rollout``), the prefix tree (``tree``), the
objectives (``losses``: the policy loss and the critic's value loss), advantage estimation (``advantages``), the
partition of a step over ranks (``balance``) and the unit handed to the training side (``batch``)."""
