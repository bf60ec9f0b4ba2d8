"""Operations: the CLI, the local swarm launcher, reports, status, health, metrics and logs."""
