"""``contract_defaults``: the defaults runlane's behaviour contract is stated in.

The seeds name ``contractDefaults.lease.duration`` (5 minutes): how long a publisher's claim
on an outbox item lasts before another maintenance replica may claim the item, so a
producer that stopped right after an eager trigger's commit delays that run's delivery by
at most this long. The RabbitMQ lane's ``claim_duration`` defaults to it; a lane built with
another ``claim_duration`` states its own. The maintenance limits of one pass are here too,
so replicas and dashboards can be checked against one source.
"""

from __future__ import annotations

from datetime import timedelta

import attrs

from runlane.maintenance import MaintenanceLimits

__all__ = ["ContractDefaults", "LeaseDefaults", "contract_defaults"]


@attrs.frozen
class LeaseDefaults:
    """``duration``: an outbox item's publisher claim (storage time); after it lapses
    another replica may claim and publish the item."""

    duration: timedelta = timedelta(minutes=5)


@attrs.frozen
class ContractDefaults:
    """The documented defaults (read-only): ``lease.duration`` (5 minutes) and the
    ``MaintenanceLimits()`` one pass uses when given none (``maintenance_limits``; the wait
    token timeout and resume limits are 100 each)."""

    lease: LeaseDefaults = attrs.field(factory=LeaseDefaults)
    maintenance_limits: MaintenanceLimits = attrs.field(factory=MaintenanceLimits)


contract_defaults = ContractDefaults()
