-- hw_classes: each rank's hardware class, from its topology rows (docs/spec.md §2); ranks
-- without one (older runs, importers) are left out.
-- columns: rank, hw_class
with

labelled as (
    select rank, hw_class
    from topology
    where hw_class is not null and hw_class <> ''
),

final as (
    select rank, any_value(hw_class) as hw_class
    from labelled
    group by rank
)

select * from final order by rank
