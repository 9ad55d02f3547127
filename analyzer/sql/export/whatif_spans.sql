-- whatif_spans: the finished spans of the steps (not the background ones), for the what-if
-- study's schema (export/whatif.py).
select rank, step, microbatch, name, kind, start_ns, end_ns
from spans
where end_ns is not null and start_ns is not null and step >= 0 and name not in ('step', 'recompute')
    and kind <> 'background'
order by rank, step, start_ns, end_ns
