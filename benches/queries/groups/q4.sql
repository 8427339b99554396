-- GROUP BY a string key of 10^5 values.
SELECT s100k, count(*) AS n, avg(v) AS a
FROM facts
GROUP BY s100k
ORDER BY n DESC, s100k
LIMIT 20
