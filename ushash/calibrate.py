"""python -m ushash.calibrate export=exports/<name> [target_false_hit_rate=0.01]: per (request modality, entry
modality) pair a Hamming radius and payload threshold for a false-hit budget, chosen on a labelled stream of
the export's own val rows (ushash.sim.calibrate, docs/cache.md) and written to <export>/calibration.json,
which `cache.calibration=` loads. Every setting: ushash/sim/calibrate.py CalibrateConfig."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.sim.calibrate import run_calibrate

log = logging.getLogger("ushash.calibrate")

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="calibrate", version_base="1.3")
@user_errors
def main(cfg: DictConfig):
    res = run_calibrate(cfg)
    print(res["table"], flush=True)
    on = sum(p.on for p in res["calibration"].pairs.values())
    log.info("%d of %d pairs on; calibration written to %s (serve by it: cache.calibration=%s)", on,
             len(res["calibration"].pairs), res["out"], res["out"])
    return res["out"]


if __name__ == "__main__":
    main()
