"""Trainer backends. `torch_trainer.TorchTrainer` is the native one."""
