"""A chain of steps (SFT -> reward model -> PPO): running it, and whether its next step can work."""
