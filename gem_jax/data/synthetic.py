"""A synthetic ads stream with a planted ground-truth model, for training and testing without real data.

`SyntheticAdsStream(spec, cfg).block(index, size)` returns `size` examples laid out by an ads
`FeatureSpec` (`ads_feature_spec`); a block is a pure function of (cfg.seed, index, size), so a stream
position is one integer and train / eval streams are disjoint index ranges. Labels come from a known
model whose true logits ride along in `planted_logits_nxK`, so the best achievable NE is known.

The world. Every hidden attribute is a counter-based function of an id (splitmix64 of (seed, id)), so a
table of 10^9 rows costs nothing. An ad id is a scrambled (affine bijection mod vocab) "slot" x; the ad's
category is x mod C and x // C is its popularity rank inside that category. This makes "a popular ad of
category c" cheap to draw, while a global Zipf draw over x is still Zipf over ads.
  ad          category, advertiser (advertisers live inside categories), latent, quality, popularity
  user        segment, 1..max_ids interest categories (Zipf over categories), latent, activity, device
  category    latent vector (the shared structure that makes affinities learnable)
A request: a Zipf user, a domain, device, hour, a session intent (a category), and a candidate ad drawn
from the user's interests, the session intent, or globally (Zipf). The history (chronological, most
recent last) mixes interest items, session items (near the end) and popular global items; actions are
more often clicks/conversions on items the user cares about; time-gap buckets are log2-spaced and
non-increasing along the sequence.

Click logit = bias + the components below (CLICK_COMPONENTS), each with the features that reveal it:
  domain                a base rate per surface                              <- domain
  affinity              category part of user latent . ad latent: mean of the user's interest
                        categories' latents . the ad category's latent      <- user_interests x ad_category
  id_affinity           the rest of that dot product (per-user / per-ad latents): head ids only
  history               log1p of the recency- and action-weighted count of history tokens of the
                        candidate's category                                 <- history x ad_category
  domain_x_category     a hashed cross                                       <- domain x ad_category
  hour_x_device         a hashed cross                                       <- hour x device
  segment_x_advertiser  a rank-4 cross                                       <- user_segment x advertiser_id
  quality, bid          linear dense terms                                   <- dense
  popularity            a small per-ad term                                  <- ad_id (head ads only)
Conversion logit (of P(conversion | click)) = bias + advertiser + affinity + dense terms. Both biases
are fitted once at construction so the rates match cfg.click_rate and cfg.conversion_rate.

Letters: n examples in a block, T history tokens of a block, M max interests, L latent width.

This module never allocates anything of a table's vocabulary size (small tables such as categories may
be cached), never loops in Python over examples or tokens, and never uses global random state.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from gem_jax.data.batch import Examples
from gem_jax.data.counter_hash import Scramble, hash_ids, hash_key, normal, uniform, zipf_rank
from gem_jax.data.spec import FeatureSpec
from gem_jax.metrics import normalized_entropy_from_logits

CLICK_COMPONENTS = ("domain", "affinity", "id_affinity", "history", "domain_x_category", "hour_x_device",
                    "segment_x_advertiser", "quality", "bid", "popularity")
_DENSE = ("ad_quality", "user_activity", "bid")
_NEEDED_SPARSE = ("user_id", "user_segment", "user_interests", "device", "hour", "ad_id", "advertiser_id",
                  "ad_category")
_NEEDED_FIELDS = ("item_id", "item_category", "action", "time_gap")
_BLOCK_TAG, _REPORT_TAG, _CALIBRATION_TAG = 1, 2, 3
_CACHE_LIMIT = 1 << 16  # hashed attributes of tables at most this big are computed once and cached
_U64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """The synthetic world and its planted model. Strengths are logit-scale weights of each component."""
  seed: int = 0
  # The training stream's first block: runs that differ only here see the same world (ids, planted model,
  # evaluation set) on disjoint training examples (gem_jax/bench/fp8_parity.py's seeds).
  first_block: int = 0
  zipf_exponent: float = 1.1           # users and ads (and ads inside a category)
  interest_zipf_exponent: float = 0.9  # how concentrated user interests are over categories
  history_mu: float = 3.3              # log-normal history length before the cap at sequence.max_len
  history_sigma: float = 0.8
  empty_history_prob: float = 0.05
  latent_dim: int = 8
  interest_token_prob: float = 0.7     # an older history token comes from an interest (else global)
  session_token_prob: float = 0.6      # a token of the recent session comes from the session intent
  session_mean_len: float = 4.0
  candidate_interest_prob: float = 0.4  # the candidate comes from the interests / the session / anywhere
  candidate_session_prob: float = 0.15
  click_rate: float = 0.03
  conversion_rate: float = 0.10        # among clicks
  domain_strength: float = 0.45
  affinity_strength: float = 1.7
  id_latent_weight: float = 0.5        # per-id part of user and ad latents, relative to the category part
  history_strength: float = 0.8
  domain_category_strength: float = 0.45
  hour_device_strength: float = 0.4
  segment_advertiser_strength: float = 0.45
  quality_strength: float = 0.4
  bid_strength: float = 0.35
  popularity_strength: float = 0.25
  conv_advertiser_strength: float = 0.6
  conv_affinity_strength: float = 1.5
  conv_quality_strength: float = 0.4
  conv_bid_strength: float = -0.3
  calibration_examples: int = 65536

  def __post_init__(self):
    for name in ("click_rate", "conversion_rate"):
      if not 0.0 < getattr(self, name) < 1.0:
        raise ValueError(f"SyntheticConfig.{name} must be in (0, 1), got {getattr(self, name)}")
    for name in ("empty_history_prob", "interest_token_prob", "session_token_prob",
                 "candidate_interest_prob", "candidate_session_prob"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"SyntheticConfig.{name} must be in [0, 1], got {getattr(self, name)}")
    if self.candidate_interest_prob + self.candidate_session_prob > 1.0:
      raise ValueError("SyntheticConfig: candidate_interest_prob + candidate_session_prob must be <= 1")
    if self.zipf_exponent <= 0 or self.interest_zipf_exponent <= 0:
      raise ValueError("SyntheticConfig: Zipf exponents must be positive")
    if not 0 <= self.seed <= _U64:
      raise ValueError(f"SyntheticConfig.seed must be in [0, 2**64), got {self.seed}")
    if self.first_block < 0:
      raise ValueError(f"SyntheticConfig.first_block must be >= 0, got {self.first_block}")
    if self.latent_dim < 1 or self.history_sigma < 0 or self.calibration_examples < 1024:
      raise ValueError("SyntheticConfig: latent_dim >= 1, history_sigma >= 0, calibration_examples >= 1024")


def _cached(fn, vocab: int):
  """fn(ids) itself, or a lookup into fn(all ids) when the table is small: the same values either way."""
  if vocab > _CACHE_LIMIT:
    return fn
  table = fn(np.arange(vocab))
  return lambda ids: table[ids]


def _ids(ids, vocab: int, name: str) -> np.ndarray:
  ids = np.asarray(ids)
  bad = (ids < 0) | (ids >= vocab)
  if bad.any():
    raise ValueError(f"{name}: id {ids[bad].flat[0]} is outside [0, {vocab})")
  return ids


def _sigmoid(z: np.ndarray) -> np.ndarray:
  return 0.5 * (1.0 + np.tanh(0.5 * z))


def _fit_bias(z: np.ndarray, rate: float, weights: np.ndarray | None = None) -> float:
  """b with weighted mean sigmoid(z + b) == rate (bisection; the mean is increasing in b)."""
  w = np.ones_like(z) if weights is None else weights
  lo, hi = -30.0, 30.0
  for _ in range(60):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if np.average(_sigmoid(z + mid), weights=w) < rate else (lo, mid)
  return 0.5 * (lo + hi)


def _check_spec(spec: FeatureSpec) -> None:
  """The stream fills an ads spec (ads_feature_spec): name exactly what does not fit."""
  got = {f.name for f in spec.sparse}
  if got != set(_NEEDED_SPARSE):
    raise ValueError(f"SyntheticAdsStream needs exactly the sparse features {sorted(_NEEDED_SPARSE)};"
                     f" spec has {sorted(got)}")
  fields = tuple(f.name for f in spec.sequence.fields)
  if set(fields) != set(_NEEDED_FIELDS):
    raise ValueError(f"SyntheticAdsStream needs history fields {_NEEDED_FIELDS}; spec has {fields}")
  dense = {f.name: f.dim for f in spec.dense}
  if dense != {name: 1 for name in _DENSE}:
    raise ValueError(f"SyntheticAdsStream needs the dense features {_DENSE} of dim 1; spec has {dense}")
  if spec.task_names != ("click", "conversion"):
    raise ValueError(f"SyntheticAdsStream needs tasks ('click', 'conversion'); spec has {spec.task_names}")
  if spec.sparse_feature("user_interests").max_ids < 1:
    raise ValueError("feature 'user_interests' needs max_ids >= 1")
  seq = {f.name: spec.table(f.table).vocab_size for f in spec.sequence.fields}
  feat = {f.name: spec.table(f.table).vocab_size for f in spec.sparse}
  for a, b in (("item_id", "ad_id"), ("item_category", "ad_category"), ("item_category", "user_interests")):
    if seq.get(a, feat.get(a)) != feat[b]:
      raise ValueError(f"{a!r} and {b!r} must index tables of the same size")
  if seq["action"] < 4 or seq["time_gap"] < 2:
    raise ValueError(f"history field 'action' needs >= 4 ids and 'time_gap' >= 2; got {seq}")
  if feat["ad_category"] > feat["ad_id"]:
    raise ValueError(f"table of 'ad_category' ({feat['ad_category']}) must not exceed that of 'ad_id'"
                     f" ({feat['ad_id']}): every category needs ads")
  big = [t.name for t in spec.tables if t.vocab_size > np.iinfo(np.int32).max]
  if big:
    raise ValueError(f"tables {big} have more rows than int32 ids can address")
  if spec.sequence.max_len < 1:
    raise ValueError("sequence.max_len must be >= 1")


_CALIBRATED: dict[tuple, tuple[float, float]] = {}   # (spec, config) -> (click bias, conversion bias)


class SyntheticAdsStream:
  """Deterministic blocks of synthetic ads examples with planted labels (see the module docstring)."""

  def __init__(self, spec: FeatureSpec, cfg: SyntheticConfig = SyntheticConfig()):
    _check_spec(spec)
    self.spec, self.cfg = spec, cfg
    vocab = lambda name: spec.table(spec.sparse_feature(name).table).vocab_size
    self._U, self._N, self._A = vocab("user_id"), vocab("ad_id"), vocab("advertiser_id")
    self._C, self._S = vocab("ad_category"), vocab("user_segment")
    self._DV, self._H = vocab("device"), vocab("hour")
    seq = spec.sequence
    self._G = spec.table(seq.fields[seq.field_index("time_gap")].table).vocab_size
    self._M, self._D = spec.sparse_feature("user_interests").max_ids, len(spec.domains)
    self._k = lambda salt: hash_key(cfg.seed, salt)
    k, L, R = self._k, cfg.latent_dim, 4
    self._user_scramble = Scramble.make(self._U, k("user_order"))
    self._ad_scramble = Scramble.make(self._N, k("ad_order"))
    self._adv_scramble = Scramble.make(self._A, k("advertiser_order"))
    self._cat_scramble = Scramble.make(self._C, k("category_order"))
    def vectors(salt: str, width: int):
      return lambda ids: normal(hash_ids(k(salt), ids[..., None], np.arange(width))) / math.sqrt(width)

    def scalars(salt: str):
      return lambda ids: normal(hash_ids(k(salt), ids))

    # Unit-norm category latents: the affinity scale then does not hinge on a few head categories' norms.
    unit = lambda v: v / np.linalg.norm(v, axis=-1, keepdims=True)
    self._cat_latent = _cached(lambda c: unit(vectors("category_latent", L)(c)), self._C)
    self._segment_vec = _cached(vectors("segment_vector", R), self._S)
    self._advertiser_vec = _cached(vectors("advertiser_vector", R), self._A)
    self._advertiser_bid = _cached(scalars("advertiser_bid"), self._A)
    self._advertiser_conv = _cached(scalars("advertiser_conversion"), self._A)
    self._domain_x_category = _cached(scalars("domain_x_category"), self._D * self._C)
    self._hour_x_device = _cached(scalars("hour_x_device"), self._H * self._DV)
    self._user_latent, self._ad_latent = vectors("user_latent", L), vectors("ad_latent", L)
    spread = np.linspace(1.0, -1.0, self._D) if self._D > 1 else np.zeros(1)
    self._domain_bias = cfg.domain_strength * spread
    self._domain_p = 0.5**np.arange(self._D) / (0.5**np.arange(self._D)).sum()
    hour_w = 1.0 + 0.6 * np.sin(2.0 * np.pi * (np.arange(self._H) / self._H - 0.3))
    self._hour_p = hour_w / hour_w.sum()
    # The biases make the mean rates match the config; fitted on a calibration sample, once per process for
    # each (spec, config): they are functions of the two alone, and drawing the sample takes seconds at long
    # histories (xl: 9 s at the default 65536 requests), which a process building a config twice would repeat.
    key = (spec, cfg)
    if key not in _CALIBRATED:
      self._click_bias = self._conv_bias = 0.0
      _, parts, conv_z = self._draw(self._rng(_CALIBRATION_TAG, 0), cfg.calibration_examples)
      click_z = sum(parts.values())
      click_bias = _fit_bias(click_z, cfg.click_rate)
      conv_bias = _fit_bias(conv_z, cfg.conversion_rate, weights=_sigmoid(click_z + click_bias))
      _CALIBRATED[key] = (click_bias, conv_bias)
    self._click_bias, self._conv_bias = _CALIBRATED[key]

  # ---- hidden attributes (pure functions of ids) ------------------------------------------------------
  def ad_category(self, ad_id: np.ndarray) -> np.ndarray:
    return self._ad_scramble.inverse(_ids(ad_id, self._N, "ad_id")) % self._C

  def ad_advertiser(self, ad_id: np.ndarray) -> np.ndarray:
    ad_id = _ids(ad_id, self._N, "ad_id")
    return self._advertiser(ad_id, self._ad_scramble.inverse(ad_id))

  def user_segment(self, user_id: np.ndarray) -> np.ndarray:
    user_id = _ids(user_id, self._U, "user_id")
    return (hash_ids(self._k("segment"), user_id) % np.uint64(self._S)).astype(np.int64)

  def user_interests(self, user_id: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(interests_nxM: distinct categories ascending, -1 padded; counts_n in [1, M])."""
    user_id, M = _ids(user_id, self._U, "user_id"), self._M
    count_n = 1 + (hash_ids(self._k("interest_count"), user_id) % np.uint64(M)).astype(np.int64)
    u_nxM = uniform(hash_ids(self._k("interest"), user_id[:, None], np.arange(M)))
    cats_nxM = self._cat_scramble(zipf_rank(u_nxM, self._C, self.cfg.interest_zipf_exponent))
    big = np.int64(self._C)
    cats_nxM = np.sort(np.where(np.arange(M) < count_n[:, None], cats_nxM, big), axis=1)
    dup = np.zeros_like(cats_nxM, dtype=bool)
    dup[:, 1:] = cats_nxM[:, 1:] == cats_nxM[:, :-1]
    cats_nxM = np.sort(np.where(dup, big, cats_nxM), axis=1)
    return np.where(cats_nxM == big, -1, cats_nxM), (cats_nxM < big).sum(axis=1)

  def _advertiser(self, ad_id: np.ndarray, slot: np.ndarray) -> np.ndarray:
    # An advertiser's ads share a category when there are more advertisers than categories.
    per_category = np.uint64(max(1, self._A // self._C))
    j = (hash_ids(self._k("advertiser_of_ad"), ad_id) % per_category).astype(np.int64)
    return self._adv_scramble((slot % self._C + self._C * j) % self._A)

  def _slots(self, u: np.ndarray, category: np.ndarray) -> np.ndarray:
    """Zipf ad slots: inside `category` where it is >= 0, over all ads where it is -1."""
    inside = category >= 0
    n_eff = np.where(inside, (self._N - 1 - category) // self._C + 1, self._N)
    rank = zipf_rank(u, n_eff, self.cfg.zipf_exponent)
    return np.where(inside, category + self._C * rank, rank)

  # ---- sampling ------------------------------------------------------------------------------------------
  def _rng(self, tag: int, index: int) -> np.random.Generator:
    s, i = self.cfg.seed, index
    # Fixed-width 32-bit words, so that distinct (seed, tag, index) never give the same entropy.
    words = [s & 0xFFFFFFFF, s >> 32, tag, i & 0xFFFFFFFF, i >> 32]
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(words)))

  def _draw(self, rng: np.random.Generator, n: int):
    """Features of n requests, the click logit's components and the conversion logit (biases excluded)."""
    cfg, C = self.cfg, self._C
    rows = np.arange(n)
    user = self._user_scramble(zipf_rank(rng.random(n), self._U, cfg.zipf_exponent))
    interests_nxM, count_n = self.user_interests(user)
    segment = self.user_segment(user)
    activity = normal(hash_ids(self._k("activity"), user))
    domain = rng.choice(self._D, size=n, p=self._domain_p)
    usual_device = (hash_ids(self._k("device"), user) % np.uint64(self._DV)).astype(np.int64)
    device = np.where(rng.random(n) < 0.85, usual_device, rng.integers(0, self._DV, n))
    hour = rng.choice(self._H, size=n, p=self._hour_p)
    session_cat = self._cat_scramble(zipf_rank(rng.random(n), C, cfg.interest_zipf_exponent))

    # The candidate: targeted at an interest or the session intent, or anything (Zipf).
    u = rng.random((3, n))
    liked = interests_nxM[rows, (u[1] * count_n).astype(np.int64)]
    p_int, p_sess = cfg.candidate_interest_prob, cfg.candidate_session_prob
    target = np.where(u[0] < p_int, liked, np.where(u[0] < p_int + p_sess, session_cat, -1))
    slot = self._slots(u[2], target)
    ad, cat = self._ad_scramble(slot), slot % C
    advertiser = self._advertiser(ad, slot)

    history, lengths, hist_match = self._history(rng, n, interests_nxM, count_n, session_cat, activity, cat)

    quality = normal(hash_ids(self._k("quality"), ad))
    bid = 0.7 * self._advertiser_bid(advertiser) + 0.714 * rng.standard_normal(n)
    dense = {"ad_quality": quality, "user_activity": activity, "bid": bid}
    interest_lat_nxMxL = self._cat_latent(np.maximum(interests_nxM, 0)) * (interests_nxM >= 0)[..., None]
    user_cat_nxL = interest_lat_nxMxL.sum(axis=1) / count_n[:, None]
    ad_cat_nxL = self._cat_latent(cat)
    user_own_nxL = cfg.id_latent_weight * self._user_latent(user)
    ad_own_nxL = cfg.id_latent_weight * self._ad_latent(ad)
    cat_affinity = np.einsum("nl,nl->n", user_cat_nxL, ad_cat_nxL)
    id_affinity = np.einsum("nl,nl->n", user_cat_nxL + user_own_nxL, ad_own_nxL) + np.einsum(
        "nl,nl->n", user_own_nxL, ad_cat_nxL)
    seg_adv = np.einsum("nr,nr->n", self._segment_vec(segment), self._advertiser_vec(advertiser))
    parts = {
        "domain": self._domain_bias[domain],
        "affinity": cfg.affinity_strength * cat_affinity,
        "id_affinity": cfg.affinity_strength * id_affinity,
        "history": cfg.history_strength * np.log1p(hist_match),
        "domain_x_category": cfg.domain_category_strength * self._domain_x_category(domain * C + cat),
        "hour_x_device": cfg.hour_device_strength * self._hour_x_device(hour * self._DV + device),
        "segment_x_advertiser": cfg.segment_advertiser_strength * seg_adv,
        "quality": cfg.quality_strength * quality,
        "bid": cfg.bid_strength * bid,
        "popularity": cfg.popularity_strength * normal(hash_ids(self._k("popularity"), ad)),
    }
    conv_z = (cfg.conv_advertiser_strength * self._advertiser_conv(advertiser)
              + cfg.conv_affinity_strength * (cat_affinity + id_affinity)
              + cfg.conv_quality_strength * quality + cfg.conv_bid_strength * bid)
    i32 = lambda a: a.astype(np.int32)
    feats = dict(
        sparse={"user_id": i32(user), "user_segment": i32(segment), "device": i32(device), "hour": i32(hour),
                "ad_id": i32(ad), "advertiser_id": i32(advertiser), "ad_category": i32(cat)},
        multi_hot={"user_interests": (i32(interests_nxM[interests_nxM >= 0]), i32(count_n))},
        dense_nxG=np.stack([dense[f.name] for f in self.spec.dense], axis=1).astype(np.float32),
        history=(history, lengths),
        domain_n=i32(domain))
    return feats, parts, conv_z

  def _history(self, rng, n, interests_nxM, count_n, session_cat, activity, cand_cat):
    """History tokens (TxF int32 in spec field order), lengths, and the recency- and action-weighted
    count of tokens whose category matches the candidate's (the planted history signal)."""
    cfg, max_len = self.cfg, self.spec.sequence.max_len
    raw = np.ceil(rng.lognormal(cfg.history_mu + 0.3 * activity, cfg.history_sigma))
    lengths = np.where(rng.random(n) < cfg.empty_history_prob, 0, np.clip(raw, 1, max_len)).astype(np.int64)
    T = int(lengths.sum())
    row = np.repeat(np.arange(n), lengths)
    ends = np.cumsum(lengths)
    from_end = ends[row] - 1 - np.arange(T)
    in_session = from_end < rng.geometric(1.0 / cfg.session_mean_len, n)[row]
    u = rng.random((5, T))
    from_session = in_session & (u[0] < cfg.session_token_prob)
    from_interest = ~from_session & (u[1] < cfg.interest_token_prob)
    liked = interests_nxM[row, (u[2] * count_n[row]).astype(np.int64)]
    slot = self._slots(u[3], np.where(from_session, session_cat[row], np.where(from_interest, liked, -1)))
    item, item_cat = self._ad_scramble(slot), slot % self._C
    # impression / click / conversion / other: engaged more with what the user cares about.
    engaged = from_session | from_interest
    a = u[4]
    action = ((a >= np.where(engaged, 0.55, 0.80)).astype(np.int64) + (a >= np.where(engaged, 0.85, 0.88))
              + (a >= np.where(engaged, 0.90, 0.89)))
    # Minutes from each event to the request: sums of exponential gaps from the token to the row's end.
    gaps = rng.exponential(1.0, T) * np.exp(4.5 - 0.5 * activity)[row]
    before = np.concatenate([[0.0], np.cumsum(gaps)])
    since = before[ends][row] - before[:-1]
    # Two buckets per doubling; the last bucket is open-ended (everything older than ~2**15.5 minutes).
    gap_bucket = np.minimum(np.floor(2.0 * np.log2(1.0 + since)), self._G - 1).astype(np.int64)
    weight = np.exp(-(gap_bucket - 12) / 8.0) * np.array([0.5, 1.5, 2.5, 0.2])[action]
    match = np.bincount(row, weights=weight * (item_cat == cand_cat[row]), minlength=n)
    cols = {"item_id": item, "item_category": item_cat, "action": action, "time_gap": gap_bucket}
    values = np.stack([cols[f.name] for f in self.spec.sequence.fields], axis=1).astype(np.int32)
    return values, lengths.astype(np.int32), match

  def block(self, index: int, size: int) -> Examples:
    """`size` examples, a pure function of (cfg.seed, index, size); distinct indices are independent."""
    if not 0 <= index < 2**64 or size < 1:
      raise ValueError(f"block(index={index}, size={size}): need 0 <= index < 2**64 and size >= 1")
    rng = self._rng(_BLOCK_TAG, int(index))
    feats, parts, conv_z = self._draw(rng, int(size))
    click_z = self._click_bias + sum(parts.values())
    conv_z = self._conv_bias + conv_z
    u = rng.random((2, size))
    click = u[0] < _sigmoid(click_z)
    conversion = click & (u[1] < _sigmoid(conv_z))
    return Examples(
        **feats,
        labels_nxK=np.stack([click, conversion], axis=1).astype(np.float32),
        label_mask_nxK=np.stack([np.ones(size), click], axis=1).astype(np.float32),
        planted_logits_nxK=np.stack([click_z, conv_z], axis=1).astype(np.float32))

  # ---- how much signal there is ------------------------------------------------------------------------
  def signal_report(self, num_examples: int = 200_000) -> dict:
    """Base rates, the planted (Bayes-optimal) NE per task, and for each click component the fraction of
    the gap 1 - NE lost when it is replaced by its mean (intercept refitted, so only information counts).

    NEs are expectations over the labels given the features (soft labels = planted probabilities), which
    is far less noisy than NE on sampled labels; the sampled-label click NE is reported next to it.
    """
    if num_examples < 1000:
      raise ValueError(f"signal_report(num_examples={num_examples}): need >= 1000 for meaningful rates")
    chunk, parts, conv, hist_len = 16384, [], [], []
    for i in range(-(-num_examples // chunk)):
      feats, p, c = self._draw(self._rng(_REPORT_TAG, i), min(chunk, num_examples - i * chunk))
      parts.append(p)
      conv.append(c)
      hist_len.append(feats["history"][1])
    comps = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    click_z = self._click_bias + sum(comps.values())
    conv_z = self._conv_bias + np.concatenate(conv)
    p_click, p_conv = _sigmoid(click_z), _sigmoid(conv_z)
    sampled = (self._rng(_REPORT_TAG, 2**32).random(p_click.shape[0]) < p_click).astype(np.float64)
    ne = normalized_entropy_from_logits(p_click, click_z)
    ablation = {}
    for name, comp in comps.items():
      z = click_z - comp + comp.mean()
      z = z + _fit_bias(z, float(p_click.mean()))
      ablation[name] = (normalized_entropy_from_logits(p_click, z) - ne) / (1.0 - ne)
    return {
        "num_examples": int(num_examples),
        "mean_history_len": float(np.concatenate(hist_len).mean()),
        "click": {"base_rate": float(p_click.mean()), "planted_ne": ne,
                  "planted_ne_sampled_labels": normalized_entropy_from_logits(sampled, click_z),
                  "ablation": ablation},
        "conversion": {"base_rate": float(np.average(p_conv, weights=p_click)),
                       "planted_ne": normalized_entropy_from_logits(p_conv, conv_z, weights=p_click)},
    }
