"""``kl-adapters measure`` (issue 44): the bias of a KL configuration's expected gradient, measured on the user's own
policy, reference and prompts (work in progress)."""
