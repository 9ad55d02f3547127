-- chrome_spans: spans in the order the exporter deals them into lanes.
-- output columns: rank, step, microbatch, name, kind, start_ns, end_ns, source
with final as (
    select rank, step, microbatch, name, kind, start_ns, end_ns, source
    from spans
    where start_ns is not null
    order by rank, source, start_ns, end_ns desc
)

select * from final
