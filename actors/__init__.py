"""Actor side: generation engines, the multi-turn agent loop, tools, rewards and actor pools."""
