"""What the trainer sends its trackers (tensorboard, wandb) after the optimizer steps: every `--logging_steps` steps,
the mean loss and gradient norm of the steps since the last log, and the learning rate of the step logged, as
transformers' `Trainer` logs every `logging_steps` steps.

A tracker's `log` is not free: accelerate's tensorboard tracker flushes its event file at every call (0.44 ms against
the shapes model's 29 ms step, `python benchmarks/trainer_overhead.py`), and wandb's sends the values on. Every step
is still checked for a finite loss, and the progress bar shows every step's loss. What a window has gathered is sent
at its last step, at the run's last step, and when the loop stops early (a diverging loss, an interrupt), so that no
finished step goes unlogged.
"""


class TrackerLogs:
    """The step values a run gathers for its trackers, sent every `every` steps.

    Args:
        accelerator (`Accelerator`): The run's accelerator, whose trackers get the values.
        every (`int`): `--logging_steps`.
    """

    def __init__(self, accelerator, every: int):
        self.accelerator, self.every = accelerator, every
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.step = self.lr = None

    def add(self, step: int, loss: float, grad_norm: float, lr: float) -> None:
        """Gather one step's values; at the end of a window, send them.

        Args:
            step (`int`): The optimizer step just taken (1-based).
            loss (`float`): Its loss.
            grad_norm (`float`): Its gradient norm.
            lr (`float`): Its learning rate.
        """
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.step, self.lr = step, lr
        if step % self.every == 0:
            self.send()

    def send(self) -> None:
        """Send what has been gathered since the last log, at the last step gathered (nothing when nothing is)."""
        if not self.losses:
            return
        logs = {
            "loss": sum(self.losses) / len(self.losses),
            "lr": self.lr,
            "grad_norm": sum(self.grad_norms) / len(self.grad_norms),
        }
        self.losses.clear()
        self.grad_norms.clear()
        self.accelerator.log(logs, step=self.step)
