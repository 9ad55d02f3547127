-- data_span_names: the names of the spans of kind `data` (data loading), which the what-if
-- holds as compute operations of those names.
-- columns: name
select distinct name
from spans
where kind = 'data'
order by name
