"""The sampled readout's kernel family: draft tokens drawn from their processed logits in one launch."""
