"""Before anything runs: the plan of a step, its memory pre-flight, its time and cost forecast, the machine's probes."""
