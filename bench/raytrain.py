"""The peer: Ray Train's TorchTrainer running the same function (argv[1] is the config JSON)."""

import json
import os
import sys

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.fn import train  # noqa: E402

if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    world, use_gpu = config.get("world_size", 2), config.get("use_gpu", False)
    env_vars = {"PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    if not use_gpu:
        env_vars["ACCELERATE_USE_CPU"] = "true"
    # address="local": always a new instance of its own; without it ray.init attaches to a Ray
    # already running on the machine (another bench, a test), where num_cpus is an error.
    ray.init(address="local", num_cpus=2 * world if use_gpu else 2, num_gpus=world if use_gpu else 0, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": env_vars})
    trainer = TorchTrainer(train, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=world, use_gpu=use_gpu),
                           run_config=RunConfig(storage_path=config["storage"], name="raytrain",
                                                failure_config=FailureConfig(max_failures=config.get("max_failures", 0))))
    trainer.fit()
    ray.shutdown()
