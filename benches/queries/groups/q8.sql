-- Holistic aggregates: median and standard deviation by two keys.
SELECT k10, s10, median(v) AS med, stddev(v) AS sd
FROM facts
GROUP BY k10, s10
ORDER BY k10, s10
