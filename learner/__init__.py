"""Learner side: Stratified GRPO advantages, policy losses, the DeepSpeed learner, weight publishing."""
