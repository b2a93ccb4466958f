"""The training world every case builds: layouts, the setup on a rank, models, optimizers, FSDP2
policies, points of a training loop, and the modes a state dict leaves a setup and comes back in."""
