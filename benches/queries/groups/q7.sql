-- Top 2 rows per group of 10^5 groups (a window function).
SELECT k10, count(*) AS n, sum(v) AS s
FROM (
  SELECT k10, v, row_number() OVER (PARTITION BY k100k ORDER BY v DESC, id) AS rn
  FROM facts
) t
WHERE rn <= 2
GROUP BY k10
ORDER BY k10
