-- chrome_bounds: the time span of a run's spans and collectives, for the trace's origin.
-- output columns: lo_ns, hi_ns
with times as (
    select start_ns as lo_ns, coalesce(end_ns, start_ns) as hi_ns from spans
    union all
    select least(issue_ns, start_ns) as lo_ns, coalesce(end_ns, start_ns) as hi_ns
    from collectives
),

final as (
    select min(lo_ns) as lo_ns, max(hi_ns) as hi_ns from times
)

select * from final
