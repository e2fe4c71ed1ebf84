"""The readout kernel family: draft tokens drawn from their processed logits in one launch
(`propose`), the greedy drafts' argmax over the vocabulary (`argmax`), and a Markov head's greedy
drafts without their logits (`markov_argmax`)."""
