-- A running total per small group (a window over every row).
SELECT k10, max(run) AS m
FROM (
  SELECT k10, sum(q) OVER (PARTITION BY k10 ORDER BY id ROWS UNBOUNDED PRECEDING) AS run
  FROM facts
) t
GROUP BY k10
ORDER BY k10
