"""epdraft.target."""
