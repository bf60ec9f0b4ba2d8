"""The outer round: DiLoCo's outer state and step, the one OuterRound both loops drive, the seam to the swarm, the one host copy of the global state."""
