"""The node's side of the swarm: the session the outer round talks to, the served and adopted state, catching up, joining."""
