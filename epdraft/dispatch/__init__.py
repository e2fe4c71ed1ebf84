"""epdraft.dispatch."""
