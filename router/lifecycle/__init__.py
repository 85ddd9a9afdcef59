"""When a model loads, sleeps, yields its room and stops: the ``supervisor`` (the one
executor: leases, wait queues, loads, stops, the death watch), the ``policy`` it asks
(plain functions that never await), the ``room_maker`` and ``idle_reaper`` it owns, the
``replica`` records it keeps per running worker, the ``prefix_index`` of what it sent to
each replica, and hot ``reload`` of the preset. It never touches HTTP.

Must not import: ``router.api``.
"""
