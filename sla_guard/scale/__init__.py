"""P/D rescaling advisor: sizing (core), online learning (learn), guardrails, the guard evaluator
(advisor), HTTP interfaces (api), actuators and replay policies."""
