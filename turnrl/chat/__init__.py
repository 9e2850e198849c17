"""The token-exact context: chat template families (:mod:`~turnrl.chat.templates`) and the tokens each new
message adds to a conversation, templated alone and checked against a full re-render
(:mod:`~turnrl.chat.template_deltas`)."""
