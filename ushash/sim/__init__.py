"""The semantic-cache workload evaluation (`python -m ushash.cachesim`, docs/cache.md, "Semantic cache
evaluation" protocol):

1. Equivalence classes (`pool`): one per item (feature-store `group`) of the split. Its members are the
   item's rows in every modality (an image, its captions, its sound), plus variants (`augment`):
   - pre-extracted features (default): `variants.perturb` copies of every row with Gaussian noise of
     relative norm `variants.noise` added in feature space, a stand-in for re-encoded / cropped images
     and re-recorded / noised sounds when the raw media are not used (named "feature-space perturbation"
     in the report);
   - `raw_media=true`: the dataset's media are loaded (ushash.data.datasets) and really transformed, then
     encoded with the export's frozen encoder: images cropped to `crop_frac` of each side (at a random
     offset) and JPEG re-encoded at `jpeg_quality`; sounds with white noise at `snr_db` and a -6 dB gain;
     captions also with their case and punctuation changed.
2. A stream (`stream`) of `n_requests`: a class drawn from a Zipf law of skew `zipf_s` over a random
   ranking of classes, then one of its members uniformly. The stream has a clock (`seconds_per_request`),
   so TTLs act, and the head's revision changes at `revision_change_at` of the stream.
3. Replay (`replay`): each request looks up the cache under test; a hit is correct when the entry's class
   is the request's, a false hit otherwise (its wrong answer is served); a miss computes the answer (the
   class) and stores it. Reported: hit rate, false-hit rate per request and per hit, oracle hit rate
   (requests whose class was requested before: the best any cache can do), misses whose nearest cached
   entry had the right class, stale hits (served from an entry of an older revision or past its expiry),
   lookup latency p50/p99 (codes precomputed: cache work only), bytes used.
4. Caches under test (`adapters`, one `CacheUnderTest` protocol) on the same stream: an exact-key cache
   (sha256 of the normalised input), a float-embedding cosine-threshold cache like GPTCache / RedisVL (the
   head's float z, faiss IndexFlatIP, cosine >= threshold), LSH codes of the same z (random hyperplanes,
   same bits) and US-HASH codes, each with and without the payload check. A sweep over the radius
   (thresholds for the float cache, and the payload threshold at the configured radius) is plotted as hit
   rate against false-hit rate (`report`).

Writes results.json, results.md and sweep.png to experiments/cachesim/<name>/ (or `out`). Every setting:
`ushash.sim.config.CacheSimConfig` (registered as the `schema_cachesim` Hydra schema on import).
"""

from ushash.sim.config import CacheSimConfig, register_schema

register_schema()

__all__ = ["CacheSimConfig", "register_schema"]
