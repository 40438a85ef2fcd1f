"""The run's supervisor on the trainer's side: the generation server, the rollout worker, the queue between them
and the weight sync, with every rule for restarting, reconnecting and stopping them."""
