"""Secure aggregation: the server learns the sum of the clients' vectors and nothing else.

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning", CCS
2017, simulated faithfully in one process:

1. Advertise keys: each client draws an X25519 key pair (RFC 7748, from the `cryptography`
   package) and a 32-byte self-mask seed b_u; the public keys go to every participant.
2. Share keys: each client splits b_u and its X25519 private key into n Shamir shares with
   threshold t (over the prime field GF(2^521 - 1)) and hands one pair to each participant. In
   the real protocol the shares are encrypted for their recipient and relayed by the server;
   here they pass between the client objects directly and the server never holds them.
3. Masked input: a client that is still online encodes its vector in fixed point into the ring
   Z_(2^ring_bits) and sends y_u = x_u + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv),
   where s_uv = HKDF-SHA256(X25519(u, v)) is the pairwise seed both ends derive on their own and
   PRG is AES-256 in counter mode. Pairwise masks cancel in the sum; self-masks protect a client
   whose pairwise masks get removed after it was thought to have dropped.
4. Unmasking: clients still online send, for each client that sent y, its share of b; for each
   client that dropped before sending y, its share of the private key. With >= t shares the
   server rebuilds the self-masks of the senders and the pairwise masks of the dropped, removes
   them, and decodes the sum. Fewer than t live clients -> `SecureAggregationError`.

`SecureAggregationServer` only ever receives masked vectors and (at unmasking) the shares the
protocol reveals; the plain vectors exist only inside `SecureAggregationClient`.

A simulation needs the protocol's output, not its secrecy (every party lives in one process),
so `config.secagg.simulation='sum'` (the default) computes that output directly: the ring sum
of the senders' encodings, with the same quorum failures (`secure_sum`, `ring_sum`). It is
equal to running the parties bit for bit, and 'protocol' runs them, for those who study the
protocol itself (its cost grows with participants^2 x model size: at 100 participants of a
51k-parameter model, about a second per round on this project's 2-core machine;
docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedjax_pfedes.errors import ConfigError

PRIME = 2 ** 521 - 1  # Mersenne prime: the Shamir field
PROTOCOL_SIMULATIONS = ("sum", "protocol")  # what `secure_sum` runs


class SecureAggregationError(RuntimeError):
    """The protocol cannot finish (too few clients online to unmask)."""


# --- fixed point in Z_(2^bits) ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RingEncoding:
    """Fixed point with `fraction_bits` fractional bits in the ring of 2^`ring_bits` integers
    (the values `config.secagg` declares and range-checks: `SecAggSection`)."""

    ring_bits: int
    fraction_bits: int

    @property
    def mask(self) -> np.uint64:
        return np.uint64((1 << self.ring_bits) - 1)

    def max_abs(self, num_summands: int) -> float:
        """Largest |value| a client may send so a sum of `num_summands` cannot wrap around."""
        return (2.0 ** (self.ring_bits - 1) - 1) / 2.0 ** self.fraction_bits / num_summands

    def largest_fraction_bits(self, num_summands: int, max_value: float) -> int:
        """The most fractional bits with which `num_summands` values of |x| <= `max_value` sum
        without wrapping around (0 when none do)."""
        room = (2.0 ** (self.ring_bits - 1) - 1) / (num_summands * max_value)
        return max(0, math.floor(math.log2(room))) if room >= 1 else 0

    def encode(self, x: np.ndarray) -> np.ndarray:
        scaled = np.round(np.asarray(x, np.float64) * 2.0 ** self.fraction_bits).astype(np.int64)
        return scaled.view(np.uint64) & self.mask

    def encode_unchecked(self, x: np.ndarray) -> np.ndarray:
        """What a client that skips its own range check puts on the wire: its values in fixed
        point taken modulo 2^ring_bits, so a value beyond the range wraps around (the sum then
        carries an arbitrary ring element: secure aggregation cannot tell). Non-finite values
        have no fixed-point form; a rogue client's NaN lands as 0 and +-Inf as the extreme."""
        scaled = np.asarray(x, np.float64) * 2.0 ** self.fraction_bits
        scaled = np.clip(np.nan_to_num(scaled, nan=0.0), -2.0 ** 62, 2.0 ** 62)
        return np.round(scaled).astype(np.int64).view(np.uint64) & self.mask

    def decode(self, v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, np.uint64) & self.mask
        signed = v.view(np.int64) if self.ring_bits == 64 else np.where(
            v >= np.uint64(1 << 31), v.astype(np.int64) - (1 << 32), v.astype(np.int64))
        return signed.astype(np.float64) / 2.0 ** self.fraction_bits


def prg(seed: bytes, length: int, encoding: RingEncoding) -> np.ndarray:
    """`length` uniform ring elements from a 32-byte seed (AES-256-CTR keystream)."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(b"\x00" * 16)).encryptor()
    stream = encryptor.update(b"\x00" * (8 * length)) + encryptor.finalize()
    return np.frombuffer(stream, dtype=np.uint64).copy() & encoding.mask


# --- Shamir t-of-n over GF(PRIME) -------------------------------------------------------------

def shamir_share(secret: int, threshold: int, num_shares: int,
                 rng: np.random.Generator) -> list[tuple[int, int]]:
    """Shares (x, f(x)), x = 1..num_shares, of a random degree t-1 polynomial with f(0) = secret."""
    if not 1 <= threshold <= num_shares:
        raise ValueError(f"Shamir threshold must be in [1, {num_shares}], got {threshold}")
    coefficients = [secret] + [int.from_bytes(rng.bytes(66), "big") % PRIME
                               for _ in range(threshold - 1)]
    shares = []
    for x in range(1, num_shares + 1):
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % PRIME
        shares.append((x, y))
    return shares


def shamir_reconstruct(shares: list[tuple[int, int]], threshold: int) -> int:
    """f(0) by Lagrange interpolation from at least `threshold` distinct shares."""
    if len({x for x, _ in shares}) < threshold:
        raise SecureAggregationError(f"cannot reconstruct a secret: {threshold} shares needed, "
                                     f"got {len(shares)}")
    points = shares[:threshold]
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    return secret


# --- key agreement ----------------------------------------------------------------------------

def _raw_public(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def pairwise_seed(private_key: X25519PrivateKey, peer_public: bytes) -> bytes:
    """s_uv: HKDF-SHA256 of the X25519 shared secret (the same at both ends)."""
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"fedjax-pfedes secagg pairwise mask").derive(shared)


def _pairwise_mask(own: int, peer: int, seed: bytes, length: int, enc: RingEncoding
                   ) -> np.ndarray:
    """+PRG(s_uv) for the smaller id, -PRG(s_uv) for the larger: cancels in the sum."""
    mask = prg(seed, length, enc)
    return mask if own < peer else (np.uint64(0) - mask) & enc.mask


# --- the parties ------------------------------------------------------------------------------

class SecureAggregationClient:
    """One participant. Holds its plain vector; only masked data and shares leave it."""

    def __init__(self, client_id: int, rng: np.random.Generator, encoding: RingEncoding):
        self.id = client_id
        self.encoding = encoding
        self._rng = rng
        self._key = X25519PrivateKey.from_private_bytes(rng.bytes(32))
        self._self_seed = rng.bytes(32)
        self._received: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}
        self._publics: dict[int, bytes] = {}

    def advertise(self) -> bytes:
        return _raw_public(self._key.public_key())

    def share_keys(self, public_keys: dict[int, bytes], threshold: int
                   ) -> dict[int, tuple[tuple[int, int], tuple[int, int]]]:
        """Shares of (self-mask seed, private key) for every participant, keyed by recipient."""
        self._publics = dict(public_keys)
        ids = sorted(public_keys)
        b = shamir_share(int.from_bytes(self._self_seed, "big"), threshold, len(ids), self._rng)
        s = shamir_share(int.from_bytes(_raw_private(self._key), "big"), threshold, len(ids),
                         self._rng)
        return {v: (b[i], s[i]) for i, v in enumerate(ids)}

    def receive_shares(self, sender: int, shares: tuple[tuple[int, int], tuple[int, int]]):
        self._received[sender] = shares

    def masked_input(self, vector: np.ndarray, checked: bool = True) -> np.ndarray:
        """y_u: the fixed-point vector plus self mask plus signed pairwise masks (`checked`
        False: a client that skipped its range check, `RingEncoding.encode_unchecked`)."""
        enc = self.encoding
        y = enc.encode(vector) if checked else enc.encode_unchecked(vector)
        y = (y + prg(self._self_seed, y.shape[0], enc)) & enc.mask
        for v, public in self._publics.items():
            if v != self.id:
                seed = pairwise_seed(self._key, public)
                y = (y + _pairwise_mask(self.id, v, seed, y.shape[0], enc)) & enc.mask
        return y

    def unmask_shares(self, sent: set[int], dropped: set[int]) -> dict[int, tuple[str, tuple]]:
        """Per other client: its self-seed share if it sent y, its key share if it dropped."""
        out = {}
        for v, (b_share, s_share) in self._received.items():
            if v in sent:
                out[v] = ("self_seed", b_share)
            elif v in dropped:
                out[v] = ("private_key", s_share)
        return out


class SecureAggregationServer:
    """Sees public keys, masked vectors and the unmasking shares; outputs the sum."""

    def __init__(self, threshold: int, encoding: RingEncoding):
        self.threshold = threshold
        self.encoding = encoding
        self.public_keys: dict[int, bytes] = {}
        self.masked: dict[int, np.ndarray] = {}

    def receive_masked(self, client_id: int, y: np.ndarray) -> None:
        self.masked[client_id] = y

    def unmask(self, responses: dict[int, dict[int, tuple[str, tuple]]]) -> np.ndarray:
        """The decoded sum of the senders' vectors, from the live clients' shares."""
        enc, t = self.encoding, self.threshold
        senders = set(self.masked)
        dropped = set(self.public_keys) - senders
        check_quorum(len(self.public_keys), len(senders), len(responses), t)
        length = next(iter(self.masked.values())).shape[0]
        total = np.zeros(length, np.uint64)
        for y in self.masked.values():
            total = (total + y) & enc.mask
        for u in senders:  # remove self masks
            shares = [r[u][1] for r in responses.values() if u in r and r[u][0] == "self_seed"]
            seed = shamir_reconstruct(shares, t).to_bytes(32, "big")
            total = (total - prg(seed, length, enc)) & enc.mask
        for v in dropped:  # remove the dropped clients' pairwise masks from the senders' inputs
            shares = [r[v][1] for r in responses.values() if v in r and r[v][0] == "private_key"]
            key = X25519PrivateKey.from_private_bytes(
                shamir_reconstruct(shares, t).to_bytes(32, "big"))
            for u in senders:
                seed = pairwise_seed(key, self.public_keys[u])
                total = (total - _pairwise_mask(u, v, seed, length, enc)) & enc.mask
        return enc.decode(total)


def check_quorum(selected: int, senders: int, online: int, threshold: int) -> None:
    """Raises `SecureAggregationError` where the server cannot unmask: fewer than `threshold`
    senders of masked input, or fewer than `threshold` clients online to send shares."""
    if senders < threshold:
        raise SecureAggregationError(
            f"secure aggregation aborted: {senders} clients sent masked input, the "
            f"threshold is {threshold}")
    if online < threshold:
        raise SecureAggregationError(
            f"cannot unmask: {online} clients online at unmasking, at least t={threshold} "
            f"needed ({selected} selected, {selected - senders} dropped before "
            f"sending, {senders - online} after)")


@dataclasses.dataclass(frozen=True)
class SecureSumResult:
    total: np.ndarray        # decoded sum over the clients that sent masked input
    senders: tuple[int, ...]
    bytes_per_sender: float  # masked vector + key advertisement + shares sent


def secure_sum(vectors: dict[int, np.ndarray], threshold: int, encoding: RingEncoding,
               seed: int, drop_before_upload: frozenset[int] = frozenset(),
               drop_after_upload: frozenset[int] = frozenset(),
               unchecked: frozenset[int] = frozenset(), simulation: str = "protocol"
               ) -> SecureSumResult:
    """Runs the four rounds for the clients in `vectors` and returns the unmasked sum.

    With `simulation='sum'` the rounds' cryptography is skipped and the server's output is
    computed directly: the pairwise masks cancel and the self masks are removed, so a finished
    protocol outputs exactly the sum of the senders' fixed-point encodings in the ring, and it
    fails exactly where too few clients send or stay online (`check_quorum`). Same result and
    same errors as 'protocol', bit for bit (tests/upload/test_secure_aggregation.py), at the cost
    of one ring sum instead of O(participants^2 x length) keystream bytes, key agreements and
    Shamir shares.

    Args:
      vectors: client id -> its plain float vector (all the same length).
      threshold: t, the Shamir threshold (and the fewest senders the server accepts).
      seed: seeds the clients' key and mask randomness (reproducible simulation).
      drop_before_upload: clients that share keys, then go offline before sending y.
      drop_after_upload: clients that send y, then go offline before unmasking.
      unchecked: clients that run their own code and skip the range check (the server cannot
        see their vectors, so nothing rejects them).
      simulation: 'protocol' (every party's cryptography runs) or 'sum' (its output only).

    Returns:
      The decoded sum over the senders, the senders and the bytes each sent.
    """
    if simulation not in PROTOCOL_SIMULATIONS:
        raise ConfigError(f"config.secagg.simulation must be one of {PROTOCOL_SIMULATIONS} "
                         f"for secure_sum ('aggregate' is drawn by the stage), got "
                         f"'{simulation}'")
    ids = sorted(vectors)
    n = len(ids)
    length = next(iter(vectors.values())).shape[0] if vectors else 0
    rows = np.array([vectors[u] for u in ids], np.float64).reshape(n, length)
    bound = encoding.max_abs(max(n, 1))
    worst = np.max(np.abs(rows), axis=1) if length else np.zeros(n)
    for i in np.flatnonzero(~(worst <= bound)):  # beyond the range, or not finite
        u = ids[i]
        if u not in unchecked:
            raise ValueError(f"secure aggregation: client {u} has |value| {worst[i]:.3g} beyond "
                             f"the fixed-point range {bound:.3g} for {n} clients; raise "
                             "config.secagg.ring_bits or lower config.secagg.fraction_bits")
    if simulation == "sum":
        sending = np.array([u not in drop_before_upload for u in ids], bool)
        senders = [u for u, s in zip(ids, sending, strict=True) if s]
        live = [u for u in senders if u not in drop_after_upload]
        check_quorum(n, len(senders), len(live), threshold)
        total = ring_sum(rows[sending], [u not in unchecked for u in senders], encoding)
        return SecureSumResult(total, tuple(senders), bytes_per_sender(length, n, encoding))
    return _run_protocol(vectors, threshold, encoding, seed, drop_before_upload,
                         drop_after_upload, unchecked)


def _run_protocol(vectors: dict[int, np.ndarray], threshold: int, encoding: RingEncoding,
                  seed: int, drop_before_upload: frozenset[int],
                  drop_after_upload: frozenset[int], unchecked: frozenset[int]
                  ) -> SecureSumResult:
    """`secure_sum` with every party's cryptography run: key advertisement and sharing, masked
    inputs, unmasking by the clients still online."""
    ids = sorted(vectors)
    length = next(iter(vectors.values())).shape[0] if vectors else 0
    root = np.random.default_rng(seed)
    clients = {u: SecureAggregationClient(u, np.random.default_rng(
        root.integers(0, 2 ** 63)), encoding) for u in ids}
    server = SecureAggregationServer(threshold, encoding)
    server.public_keys = {u: c.advertise() for u, c in clients.items()}
    for u, c in clients.items():
        for v, shares in c.share_keys(server.public_keys, threshold).items():
            clients[v].receive_shares(u, shares)
    senders = [u for u in ids if u not in drop_before_upload]
    for u in senders:
        server.receive_masked(u, clients[u].masked_input(vectors[u], u not in unchecked))
    dropped = set(ids) - set(senders)
    live = [u for u in senders if u not in drop_after_upload]
    responses = {u: clients[u].unmask_shares(set(senders), dropped) for u in live}
    total = server.unmask(responses)
    return SecureSumResult(total, tuple(senders), bytes_per_sender(length, len(ids), encoding))


def ring_sum(rows: np.ndarray, checked: np.ndarray, encoding: RingEncoding) -> np.ndarray:
    """The decoded sum of the rows' fixed-point encodings in Z_(2^ring_bits): what the protocol
    outputs when it finishes. `rows` [senders, length] float64 (overwritten), `checked`
    [senders]: False for a client that skipped its range check
    (`RingEncoding.encode_unchecked`). The int64 encodings are summed with wrap-around, i.e.
    in Z_(2^64), which reduces to the ring: the same integers `RingEncoding.encode` masks."""
    total = np.zeros(rows.shape[1], np.uint64)
    checked = np.asarray(checked, bool)
    if checked.any():
        scaled = rows[checked] if not checked.all() else rows
        np.multiply(scaled, 2.0 ** encoding.fraction_bits, out=scaled)
        np.rint(scaled, out=scaled)
        total += np.sum(scaled.astype(np.int64).view(np.uint64), axis=0, dtype=np.uint64)
    if not checked.all():
        total += np.sum(encoding.encode_unchecked(rows[~checked]), axis=0, dtype=np.uint64)
    return encoding.decode(total & encoding.mask)


def bytes_per_sender(length: int, participants: int, encoding: RingEncoding) -> float:
    """What one client sends: its public key (32 bytes), two 521-bit Shamir shares for every
    other participant, and the masked vector of `length` ring elements (unmasking shares,
    sent only by the clients online at the end, are not counted)."""
    return length * encoding.ring_bits / 8 + 32 + 2 * 66 * (participants - 1)

