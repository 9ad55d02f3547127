-- digest_collectives (digest/collectives.sql) from stored digests rows already one per rank,
-- step and channel (written whole: analyzer/digests.py write_digests, the cache): as
-- combine_collectives.sql without its group by. Same columns and types.
select
    rank,
    "group",
    peer,
    cast(is_send as boolean) as is_send,
    step,
    n_rows,
    n_done,
    cast(busy_ns as hugeint) as busy_ns,
    first_ns as first_arrival_ns,
    last_ns as last_end_ns,
    cast(nbytes as hugeint) as nbytes,
    bus_bytes
from digest_source
where kind = 'collectives'
