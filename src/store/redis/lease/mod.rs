//! Leased quota: units a script took from a key ahead of need, for this
//! instance to spend without a round trip.
//!
//! A busy key costs one script call per request otherwise, and every call is
//! work for a Redis that all instances share. With a lease, the call that
//! admits a request also takes up to `lease_percent` of the key's capacity
//! for this instance; the requests that follow spend it here, and Redis
//! hears from this instance again when the lease runs low: a renewal ahead
//! ([`Ahead`]) tops it up in the background, so that a key in steady use
//! never makes a request wait for Redis.
//!
//! What it keeps and what it gives up:
//!
//! - **Never more than the limit.** Leased units are counted in Redis when
//!   they are taken, and spent only while that count still stands: a window
//!   lease ends with the window it was counted in (a fixed window's count,
//!   or a sliding counter's current window, which only weighs less as it
//!   slides out). A token bucket's lease sits in an escrow slot beside the
//!   level (see `bucket.lua`), which does not refill: it stays valid until
//!   its slot ends, between one and two `lease_lifetime`s after the grant
//!   (counted here from when the call was sent, so it ends here first), and
//!   is settled with the call that asks for the next one, or given back.
//! - **Exact near the limit.** A script grants a lease only when at least as
//!   much again stays in Redis (`lease` in prelude.lua), so the last units of
//!   a key are decided one request at a time. What an instance
//!   can hold back from the others is one lease per key, and only for keys
//!   it is using: a lease left idle for `lease_idle` is given back (a refund
//!   script call), and so is every lease on shutdown.
//! - **From the first request, given back only if used.** A client's
//!   first request already takes a lease, so its next ones (a page and its
//!   assets, a retry loop) are answered here. A lease never spent before it
//!   goes idle is not given back: a scan of one-off clients then costs one
//!   call per client, as without leases, and what each leaves counted is a
//!   lease of a key nobody else is using, which ends with its window or its
//!   escrow slot. One lease request per key is in flight at a time.
//! - **Sized by use where a share of the capacity is too small.** A key
//!   whose `lease_percent` share is under two units (every key under 200 at
//!   the default 1%) is leased twice what this instance asked of it in the
//!   last [`HORIZON`](size::HORIZON) (when that is two units or more) for a window, and
//!   up to four times that for a token bucket (as many horizons as one
//!   `lease_lifetime` holds, between [`BY_USE_SPAN`](size::BY_USE_SPAN) and
//!   [`BY_USE_SPAN_BUCKET`](size::BY_USE_SPAN_BUCKET): its escrow slot outlives a lifetime, while a
//!   window's lease ends with its window), at most
//!   a tenth of its capacity ([`BY_USE_SHARE`](size::BY_USE_SHARE)), once the instance has seen
//!   it for [`YOUTH`](size::YOUTH) (half a horizon): a key far below its limit then costs a round
//!   trip every few seconds instead of one per request (a lease of
//!   twice a second's use made fewer calls than one of a second's on
//!   edge-bench `spread`: single Redis 4.1 against 4.6 µs of Redis CPU per
//!   request, cluster 7.0 against 9.1; a bucket's lease of four seconds'
//!   use against two: 0.16 against 0.25 calls per request, Redis 4.6
//!   against 5.8 µs on one server), while a key seen
//!   only in a burst (a crowd arriving at once) is still decided request by
//!   request. The rule that half the room stays in Redis keeps the last
//!   units exact. What an instance can hold back of such a key is one lease
//!   of at most a tenth of its capacity, which it spends in two to four
//!   seconds at the rate it used the key in the last one: other instances may be refused
//!   while it holds it, by at most that tenth per instance, until it is
//!   spent, settled, or given back idle.
//! - **Renewed ahead, never more than one lease held.** A take that leaves
//!   a lease at what the key spends here in [`LEAD`](ahead::LEAD) (25 ms), at most an
//!   eighth of its size, sends a renewal that no request waits for (a key
//!   used a few times a second renews as it spends its last unit): a consume of nothing asking for the size less what
//!   is held, in the next call to the key's node (a lazy check, see
//!   `batch`). A token bucket's renewal settles the lease and carries its
//!   unspent units into the new grant's slot (`bucket.lua`), where they
//!   stay counted while this instance goes on spending them. The script
//!   grants it only where a whole lease of that size would be granted
//!   (counting what is held), so renewals stop as far from the limit as
//!   leases do. A renewal that fails leaves a bucket's lease unsettled
//!   until its slot ends (whether the settle ran is not known; either way
//!   its units stay counted until then).
//! - **Not for every algorithm.** The leaky bucket decides each request's
//!   delay from the queue ahead of it, and the sliding log stamps each entry
//!   with its own time (an entry stamped early would leave the window
//!   early), so both ask Redis for every request.
//!
//! Headers served from a lease show what Redis had left at the grant plus
//! the units still held here: an estimate, since other instances spend too.
//!
//! | file | responsibility |
//! |---|---|
//! | `leases.rs` | [`Leases`]: the leases of every key, taken, granted, renewed, given back, swept |
//! | `ahead.rs` | when a lease is renewed ahead, and with what ([`Ahead`]) |
//! | `size.rs` | how big a key's lease is: a share of its capacity, or its use here |
//! | `entry.rs` | one key's lease and history, and what giving it back returns ([`Unused`]) |
//!
//! Each file imports only from those below it in this table.

mod ahead;
mod entry;
mod leases;
mod size;

pub(super) use ahead::Ahead;
pub(super) use entry::Unused;
pub(super) use leases::Leases;
