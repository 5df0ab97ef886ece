"""Assembling a run: config, platform policy, setup (config -> mesh -> rules -> plan -> trainer), the planner."""
