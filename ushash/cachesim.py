"""python -m ushash.cachesim export=exports/<name>: replay a request stream through the caches under test
(ushash/sim/, docs/cache.md); returns US-HASH's hit rate at cache.radius, so a Hydra sweeper can optimise
it. Every setting: ushash/sim/config.py CacheSimConfig."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.sim.replay import run_cachesim

log = logging.getLogger("ushash.cachesim")

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="cachesim", version_base="1.3")
@user_errors
def main(cfg: DictConfig):
    res = run_cachesim(cfg)
    if cfg.get("scenario"):
        log.info("failure scenarios written to %s", res["out"])
    elif res["score"] is None:
        log.warning("methods has no ushash: no US-HASH hit rate to return")
    else:
        log.info("US-HASH hit rate at radius %s: %.4f (%s)", cfg.cache.radius, res["score"], res["out"])
    return res["score"]


if __name__ == "__main__":
    main()
