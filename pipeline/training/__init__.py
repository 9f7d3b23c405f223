"""Training the draft with speculators, below the train and eval stages.

- `worker`: one rank of the trainer (in the stage's process, or in each torchrun process);
- `data`: speculators' dataset over our hidden-state shards;
- `torchrun`: the torchrun command line of train.nproc_per_node x train.nnodes, its rendezvous, a dead rank's report;
- `speculators_cpu`: what it takes to run speculators' trainer on CPU;
- `cpu_determinism`: the pinned CPU arithmetic every CPU training runs with (the draft, and the embedded target);
- `draft`: the trained draft as eval loads it.

The train and eval stages, the model stage's embedded target and the command line use these modules;
none of them imports a stage.
"""
