"""What the trainer sends its trackers: every `--logging_steps` steps, the mean loss and gradient norm since the last
log and the learning rate, as transformers' `Trainer` does.

A tracker's `log` is not free (tensorboard's flushes its event file at every call). What a window has gathered is also
sent at the run's last step and when the loop stops early, so no finished step goes unlogged.
"""


class TrackerLogs:
    """The step values a run gathers for its trackers, sent every `every` (`--logging_steps`) steps."""

    def __init__(self, accelerator, every: int):
        self.accelerator, self.every = accelerator, every
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.step = self.lr = None

    def add(self, step: int, loss: float, grad_norm: float, lr: float) -> None:
        """Gather the values of `step` (1-based); at the end of a window, send them."""
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
