"""Pools that peers pull from, by composition.

A served backend (``tcp``, ``shm``, ``nixl``, ``mooncake``) is three pieces
put together by :class:`~kvmux.pool.served.ServedPoolBackend`:

* a :class:`~kvmux.pool.store.PoolStore` (``store``): the bounded slots and
  publications, exactly what ``cpu`` is;
* a :class:`~kvmux.pool.server.PoolServer` (``server``): the thread that
  answers peers, started by ``register`` (there is nothing to serve before);
* a :class:`~kvmux.pool.transport.PullTransport` (``transport``): where the
  pool's memory lives and how a pull's bytes travel, over the socket (``tcp``)
  or located, pinned and then moved by the consumer itself
  (:class:`~kvmux.pool.pinned.PinnedTransport`: ``shm``, ``nixl``,
  ``mooncake``).

The consumer's half (remote lookups, pulls batch by batch, lease notices) is
:class:`~kvmux.pool.puller.Puller`. The wire protocol and sockets are
:mod:`kvmux.net`'s, which knows nothing of backends.
"""
