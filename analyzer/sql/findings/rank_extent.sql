-- rank_extent: the first and last step each rank's heartbeats reach (what is on disk of it),
-- for the note on what a run cut off by its storage is missing (analyzer/findings/storage.py).
-- columns: rank, first_step, last_step
select rank, min(step) as first_step, max(step) as last_step
from heartbeats
where step >= 0
group by rank
order by rank
