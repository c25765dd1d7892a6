"""P/D rescaling advisor: sizing (core), online learning (learn), guardrails, the guard evaluator
(advisor), HTTP interfaces (api) and actuators. A library: the simulator's replay policies
(``sla_guard.sim.policy``) use it; it imports nothing of the simulator."""
