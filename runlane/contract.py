"""``contract_defaults``: the defaults runlane's behaviour contract is stated in.

``lease.duration`` (the seeds' ``contractDefaults.lease.duration``, 5 minutes) is how long a
publisher's claim on an outbox item lasts, so a producer that died right after an eager
trigger delays its run by at most that; the RabbitMQ lane's ``claim_duration`` defaults to
it. One pass's maintenance limits are here too, as one source to check replicas against.
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
