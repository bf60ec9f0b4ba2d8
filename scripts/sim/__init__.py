"""A discrete-event simulator of a dtnode swarm that runs the product's own membership code.

``scripts/tools/swarm_sim.py`` is its command line. One concept per module: ``events`` (the clock and
its heap of events), ``dht`` (records visible after a delay, lost with a probability, split by
partitions), ``links`` (latency, bandwidth, message timing), ``allreduce_cost`` (the all-reduce's
byte formulas and seconds), ``groups`` (the all-reduces in flight and the params they make),
``node`` (one daemon's life, feeding ``RoundFormation`` as ``protocol/swarm/driver.py`` does),
``faults`` (crash, freeze, restart, join, leave, partition), ``swarm`` (the world from a seed, the
run), ``report`` (per-round figures) and ``schedule`` (how much of a round the daemon's ``--overlap``
and fragment schedules hide behind training: ``scripts/bench/bench_sim_utilization.py``).
"""
