"""Split sequences that join a USP group of positions wider than a node as its guests
(`ray_zep.partition.usp_guests`).

A batch's longest documents take positions of several whole nodes (`WorkModel.usp_widths`:
13B's 40 heads allow 40 GPUs, five nodes, and nothing between one node and five). Those
groups come in steps of a whole position, so they often sit far under the level: on
`bench scale`'s 13b github batch at 4,096 GPUs (L = 8,960, level 1.14 x the mean rank)
ten documents of 218k-250k tokens take three positions of 40 GPUs each at 0.68-0.86 of the
level, 255 ranks' worth of work room among their 1,200.

Such a group (the host) takes other split sequences (rings, groups of half-node and of
whole-node positions that host no guests themselves) as `usp_guests` does its
whole-node hosts, on the same terms:
- one queue item holds them all, every guest cut over the host's positions and heads (the
  engine runs any number of sequences in an item at any U);
- the group's member work, costed over the sequences' summed ring parts at the host's U
  (`WorkModel.usp_group_costs`, whose all-to-alls cross the position's nodes), stays within
  the level, its forward within `FORWARD_SHARE` of it, and each member's tokens within L;
- guests are offered by the ranks they free, most first, each joining the host it leaves
  the least work room in;
- a host does not grow (a position is several nodes), and hosts at their floor take none.

These run after the whole-node hosts have taken theirs, where the groups on their own
need more ranks than there are (`balance`). A guest here adds busy seconds (its rows
cross the nodes of a position in the all-to-alls, and its own group may have been
cheaper), so guests join while the groups want more ranks than there are, and past that
only while the level's work still fits its ranks: the groups' busy seconds (member
seconds times ranks) and the whole sequences' work within the ranks times the level.
- Stopping as soon as the groups fit the world left the whole sequences too few ranks:
  on 13b github at 1,024 GPUs (L = 7,680) the kept level's busiest rank ended at 1.163x
  the mean rank's work, against 1.117x going on.
- Going on regardless lost where the level's work does not fit: on 13b chat at 256 GPUs
  (L = 8,960) ten rings of 2-7 ranks joining a 200-rank group at level 1.0 freed 31
  ranks for 37 ranks' worth of work, and the busiest rank ended at 1.20x rather than
  1.09x.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.work import FORWARD_SHARE, RingParts

WIDE_HOSTS = True
"""Groups of positions wider than a node take guests (module docstring)."""


def wide_guests(
    seqs: np.ndarray,
    degrees: np.ndarray,
    seconds: np.ndarray,
    usp: np.ndarray,
    host_of: np.ndarray,
    level: float,
    capacity: int,
    gpus: int,
    table,
    world: int,
    whole_work: float,
) -> None:
    """Joins split sequences to hosts of positions wider than a node (module docstring),
    writing `host_of` (the index into `seqs` of each one's host, -1 for none) and each
    host's member seconds in `seconds`; `degrees` stay (no host grows). The arguments are
    `usp_guests`' (`table`: its `PartsTable`; `world`: the ranks there are;
    `whole_work`: the level's whole sequences' work), `host_of` and `seconds` as the
    whole-node hosts left them."""
    if not WIDE_HOSTS:
        return
    hosts = np.flatnonzero((usp > gpus) & (seconds <= level) & (host_of < 0))
    if not hosts.size:
        return
    hosting = np.zeros(seqs.size, dtype=bool)
    hosting[host_of[host_of >= 0]] = True
    offered = np.flatnonzero((host_of < 0) & (usp <= gpus) & ~hosting)
    if not offered.size:
        return
    members = degrees[hosts].astype(np.float64)  # every GPU of every position
    ulysses = usp[hosts]
    positions = degrees[hosts] // ulysses
    table.ready(positions)
    row, lengths, work = table.rows(seqs)
    held = np.ceil(lengths[hosts] / members)  # the most tokens a member holds
    values = table.values
    sums = values[:, row[hosts], positions]  # 3 x hosts: diagonal, step, send
    tokens = lengths[hosts].copy()
    model = table.model

    def costs(guests: np.ndarray, on: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each of `guests` (rows) joining each host of `on` (columns) as the hosts
        stand: the host's member seconds then, and whether it fits (the level, the
        forward's share, L, and its whole work spread over the host's GPUs on top of the
        host's member work within the level)."""
        parts = sums[:, None, on] + values[:, row[guests][:, None], positions[on][None, :]]
        total, forward = model.usp_group_costs(
            RingParts(*parts), tokens[on][None, :] + lengths[guests][:, None],
            positions[on][None, :], ulysses[on][None, :],
        )  # fmt: skip
        share = np.ceil(lengths[guests][:, None] / members[on][None, :])
        spread = seconds[hosts[on]][None, :] + work[guests][:, None] / members[on][None, :]
        fit = ((total <= level) & (forward <= level * FORWARD_SHARE)
               & (held[on][None, :] + share <= capacity) & (spread <= level))  # fmt: skip
        return total, fit

    # joining only fills a host, so a sequence that fits none as they stand never will; a
    # host's column is costed again whenever it takes one
    every = np.arange(hosts.size)
    cost, fit = costs(offered, every)
    keep = fit.any(axis=1)
    offered, cost, fit = offered[keep], cost[keep], fit[keep]
    order = np.lexsort((-lengths[offered], -degrees[offered]))
    offered, cost, fit = offered[order], cost[order], fit[order]
    short = int(degrees[host_of < 0].sum()) - world  # ranks the groups want beyond the world's
    # the level's work room: its ranks at the level less the groups' busy seconds and the
    # whole sequences' work
    spare = world * level - whole_work - float((seconds * degrees)[host_of < 0].sum())
    for i, guest in enumerate(offered.tolist()):
        if short <= 0 and spare <= 0:
            break
        # the busy seconds it adds: the host's over all its ranks, less its own group's
        added = (cost[i] - seconds[hosts]) * members - seconds[guest] * degrees[guest]
        fits = fit[i] & ((short > 0) | (added <= spare))
        if not fits.any():
            continue
        h = int(np.argmax(np.where(fits, cost[i], -np.inf)))
        sums[:, h] += values[:, row[guest], positions[h]]
        tokens[h] += lengths[guest]
        held[h] += np.ceil(lengths[guest] / members[h])
        seconds[hosts[h]] = cost[i, h]
        host_of[guest] = hosts[h]
        short -= int(degrees[guest])
        spare -= float(added[h])
        if i + 1 < offered.size:  # host h as it is now, for the sequences still to come
            later, column = offered[i + 1 :], np.asarray([h])
            total, fitting = costs(later, column)
            cost[i + 1 :, h], fit[i + 1 :, h] = total[:, 0], fitting[:, 0]
