"""Generating answers: the decode loop, sampling settings, rollouts and greedy evaluation, ZeRO-3 shards."""
