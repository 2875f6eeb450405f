"""Stable-Baselines3's A2C on our protocol, configured as a2c_atari.py's defaults: the peer run.

a2c_atari.py's game (its Args' game block, played by utils.make_env: ALE v5 with sticky actions
0.25, FIRE only at a game's start, a lost life terminal for the learner, clipped rewards,
full-game returns logged) and settings, read from its Args: 16 envs x 32 steps, GAE 0.95,
vf_coef 0.5, ent_coef 0.01, gradient norm 0.5, PyTorch's RMSprop (lr 7e-4, alpha 0.99, eps
1e-5: SB3's default A2C optimizer), no advantage normalization; SB3's Nature CNN (ReLU where
our Agent has GELU before the heads). It logs what learning.py reads (charts/episodic_return
at the agent step where a game ended), prints the scripts' progress line, checkpoints and
resumes as they do.
SB3 is a benchmark-only dependency: pip install -r benchmarks/requirements.txt
Run: python benchmarks/sb3_a2c.py --seed 1 --total-timesteps 2000000
     (or as learning.py's variant sb3-a2c, beside a2c_atari.py)
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import a2c_atari  # noqa: E402  (its Args: the game and the settings copied here)
import utils  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-id", default="Breakout-v5")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--total-timesteps", type=int, default=2_000_000)
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--exp-name", default="sb3_a2c")
    parser.add_argument("--save-interval", type=int, default=100_000, help="agent steps between checkpoints")
    parser.add_argument("--resume", default=None, help="a run directory of this script to continue")
    args = parser.parse_args()
    args.env_id = utils.canonical_env_id(args.env_id)
    from stable_baselines3 import A2C
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import DummyVecEnv
    from torch.utils.tensorboard import SummaryWriter

    checkpoint = None
    if args.resume is not None:
        run_dir = Path(args.resume)
        checkpoint = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    else:
        run_dir = utils.make_run_dir(args)
    start_step = checkpoint["global_step"] if checkpoint else 0
    writer = SummaryWriter(str(run_dir), purge_step=start_step + 1 if checkpoint else None)
    stop = utils.StopSignal(run_dir / "checkpoint.pt")

    ours = a2c_atari.Args()
    assert ours.optimizer == "rmsprop" and ours.rms_alpha == 0.99 and not ours.anneal_lr  # SB3's RMSprop, constant
    game = utils.game_settings(ours)
    env_seed = args.seed + 1_000_003 * start_step  # envs cannot be checkpointed: a resume reseeds them
    envs = DummyVecEnv([utils.make_env(args.env_id, env_seed + i, game) for i in range(ours.num_envs)])
    model = A2C(
        "CnnPolicy", envs, learning_rate=ours.learning_rate, n_steps=ours.num_steps, gamma=ours.gamma,
        gae_lambda=ours.gae_lambda, ent_coef=ours.ent_coef, vf_coef=ours.vf_coef, max_grad_norm=ours.max_grad_norm,
        use_rms_prop=True, rms_prop_eps=ours.rms_eps, normalize_advantage=ours.norm_adv, seed=env_seed,
        device="cpu", verbose=0,
    )  # fmt: skip
    if checkpoint is not None:
        model.policy.load_state_dict(checkpoint["policy"])
        model.policy.optimizer.load_state_dict(checkpoint["optimizer"])
        model.num_timesteps = start_step

    def save(path):
        state = {"global_step": model.num_timesteps, "policy": model.policy.state_dict()}
        utils.save_checkpoint(path, state | {"optimizer": model.policy.optimizer.state_dict()})

    class Log(BaseCallback):
        """Full-game returns to TensorBoard, the progress line, checkpoints, a clean stop."""

        def _on_training_start(self):
            self.start, self.saved = time.time(), self.model.num_timesteps

        def _on_step(self):
            for info in self.locals["infos"]:
                if "episode" in info:  # a game ended (RecordEpisodeStatistics sits inside the life-loss wrapper)
                    writer.add_scalar("charts/episodic_return", float(info["episode"]["r"]), self.model.num_timesteps)
                    writer.add_scalar("charts/episodic_length", float(info["episode"]["l"]), self.model.num_timesteps)
            return not stop

        def _on_rollout_end(self):
            step = self.model.num_timesteps
            sps = int((step - start_step) / max(time.time() - self.start, 1e-9))
            writer.add_scalar("charts/SPS", sps, step)
            print(f"step {step:,}/{args.total_timesteps:,}  SPS: {sps}", flush=True)
            if step - self.saved >= args.save_interval:
                save(run_dir / "checkpoint.pt")
                self.saved = step

    print(f"run directory: {run_dir}", flush=True)
    model.learn(args.total_timesteps - start_step, callback=Log(), reset_num_timesteps=False)
    save(run_dir / "checkpoint.pt")
    if stop:
        print(utils.stopped_message(stop, model.num_timesteps, run_dir), flush=True)
    else:
        save(run_dir / "model.pt")
    envs.close()
    writer.close()


if __name__ == "__main__":
    main()
