"""The readout kernel family: draft tokens drawn from their processed logits in one launch
(`propose`), and a Markov head's greedy drafts without their logits (`markov_argmax`)."""
