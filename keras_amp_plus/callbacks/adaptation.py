"""The rule that moves layers between the allow and deny lists between epochs.

Evidence against a layer in one epoch is the number of overflow events
attributed to it: every forward overflow (the loss was Inf/NaN and the replay
named the layer) and every backward overflow that happened at a loss scale at or
below `trusted_backward_scale` (above it the scaler is still searching for its
scale, which is normal and is the scaler's business, not the layer's).

At the end of each epoch:

```
for layer with evidence[layer] >= deny_threshold, not yet denied:
    deny it (float32 from the next epoch); denials[layer] += 1
    wait[layer] = patience * 2 ** (denials[layer] - 1)     # hysteresis
for layer denied by this rule (never those the user denied):
    clean_epochs[layer] = clean_epochs[layer] + 1 if evidence[layer] == 0 else 0
    if denials[layer] <= max_retries and clean_epochs[layer] >= wait[layer]
            and no layer was moved back in the last `cooldown` epochs:
        move it back to low precision (allow list)
```

A layer that overflows again after being moved back is denied again and waits
twice as long; after `max_retries` returns it stays in float32.
"""

import dataclasses


@dataclasses.dataclass
class Decision:
    """One list change decided at the end of an epoch."""

    layer: str
    to: str
    reason: str
    evidence: dict


class AdaptationRule:
    """Decide list moves from per-epoch overflow evidence (see module doc).

    Args:
        deny_threshold: events attributed to one layer in one epoch that move it
            to the deny list. Defaults to `2`.
        patience: clean epochs a denied layer waits before it is tried in low
            precision again; doubled after each new denial. Defaults to `5`.
        cooldown: epochs after a layer is moved back during which no other layer
            is moved back, so new evidence points at one change. Defaults to `1`.
        max_retries: how many times a layer may be moved back; after that it
            stays denied. Defaults to `2`.
    """

    def __init__(
        self,
        deny_threshold: int = 2,
        patience: int = 5,
        cooldown: int = 1,
        max_retries: int = 2,
    ):
        self.deny_threshold = deny_threshold
        self.patience = patience
        self.cooldown = cooldown
        self.max_retries = max_retries
        self.denials = {}
        self.clean_epochs = {}
        self.last_return_epoch = None

    def decide(self, epoch: int, evidence: dict, denied: set) -> list[Decision]:
        """Return the moves for the epoch that just ended.

        Args:
            epoch: the epoch that ended (0-based).
            evidence: `{layer path: number of attributed events}` for the epoch.
            denied: the layer paths currently in float32 by any list.
        """
        decisions = []
        for layer, count in sorted(evidence.items()):
            if count >= self.deny_threshold and layer not in denied:
                self.denials[layer] = self.denials.get(layer, 0) + 1
                self.clean_epochs[layer] = 0
                decisions.append(
                    Decision(
                        layer,
                        "deny",
                        f"{count} overflow events in epoch {epoch} "
                        f"(threshold {self.deny_threshold})",
                        {"events": count, "threshold": self.deny_threshold},
                    )
                )
        just_denied = {d.layer for d in decisions}
        for layer in sorted(self.denials):
            if layer in just_denied or layer not in denied:
                continue
            clean = 0 if evidence.get(layer, 0) else self.clean_epochs[layer] + 1
            self.clean_epochs[layer] = clean
            wait = self.wait_epochs(layer)
            if (
                self.denials[layer] <= self.max_retries
                and clean >= wait
                and self._cooled_down(epoch)
            ):
                self.last_return_epoch = epoch
                self.clean_epochs[layer] = 0
                decisions.append(
                    Decision(
                        layer,
                        "allow",
                        f"{clean} clean epochs in float32 (patience {wait})",
                        {"clean_epochs": clean, "patience": wait},
                    )
                )
        return decisions

    def wait_epochs(self, layer: str) -> int:
        """Clean epochs `layer` must wait in float32 before it may move back."""
        return self.patience * 2 ** (self.denials.get(layer, 1) - 1)

    def _cooled_down(self, epoch):
        if self.last_return_epoch is None:
            return True
        return epoch - self.last_return_epoch > self.cooldown

    def get_state(self) -> dict:
        """Return the rule's memory as JSON-serializable data."""
        return {
            "denials": dict(self.denials),
            "clean_epochs": dict(self.clean_epochs),
            "last_return_epoch": self.last_return_epoch,
        }

    def set_state(self, state: dict) -> None:
        """Restore the memory returned by `get_state`."""
        self.denials = dict(state.get("denials", {}))
        self.clean_epochs = dict(state.get("clean_epochs", {}))
        self.last_return_epoch = state.get("last_return_epoch")
